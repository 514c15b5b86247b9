"""The step phase of benches/gpu_check.py: torch DDP over NCCL against phalanx DDP,
one MLP's ranks on the one device, in interleaved rounds (as benches/step_overhead.py
does over gloo)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

from gpu_phase import GROUPS, SCRIPT, Deadline, Phase, PhaseFailed, nccl_environ, shown, spread

from harness import (
    free_port,
    lighthouse_process,
    mlp_and_batches,
    start_worker,
    timed_steps,
    worker_results,
)


def run_step_worker(args: argparse.Namespace) -> None:
    """One rank of the step phase on cuda:0: torch DDP over NCCL, or phalanx DDP (on
    the CPU, over gloo, in a rehearsal)."""
    os.environ.update(nccl_environ(args.rank))
    # NCCL writes its warnings to stdout, where the driver reads this worker's result.
    os.environ.setdefault("NCCL_DEBUG_FILE", str(Path(args.out).absolute() / "nccl.%p.log"))
    import torch
    import torch.distributed as dist
    from torch import nn

    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model, batches = mlp_and_batches(args.width, args.rank)
    model = model.to(device)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    if args.worker == "torch":
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.rank,
            world_size=GROUPS,
        )
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[0] if cuda else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        import phalanx

        manager = phalanx.Manager(
            replica_id=f"g{args.rank}", lighthouse=args.lighthouse, device=device, timeout=30.0
        )
        wrapped = phalanx.DistributedDataParallel(model, manager)
        optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))

    def step(x, y):
        optimizer.zero_grad()
        nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    times = timed_steps(step, batches, args.warmup, args.steps)
    from phalanx.demo.train import fingerprint

    committed = manager.current_step() if args.worker == "phalanx" else args.warmup + args.steps
    line = {
        "median_ms": times.median_ms,
        "cpu_ms": times.cpu_ms,
        # Every rank applied the same averaged gradients: the same parameters, bit for bit.
        "fingerprint": fingerprint(list(model.state_dict().values())),
        "committed": committed,
    }
    print(json.dumps(line), flush=True)
    if args.worker == "torch":
        dist.destroy_process_group()
    else:
        manager.shutdown()


def step_phase(args: argparse.Namespace, deadline: Deadline) -> Phase:
    per_run = 40.0
    deadline.need(2 * per_run * args.rounds, "the step phase")
    out = args.out / "step"
    out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for _ in range(args.rounds):
        # Interleaved, so that a machine busy for a while weighs on both sides alike;
        # each phalanx run with a lighthouse of its own, as a new job.
        rounds.append(tuple(step_run(mode, args, out, deadline) for mode in ("torch", "phalanx")))
    params = sum(p.numel() for p in mlp_and_batches(args.width, 0)[0].parameters())
    return step_result(rounds, params, args.steps)


def step_run(
    mode: str, args: argparse.Namespace, out: Path, deadline: Deadline
) -> tuple[float, float]:
    """One run of `mode`'s 3 ranks: the job's step time (its slowest rank's median)
    and the mean CPU per step of a rank, in ms."""
    side = "torch DDP over NCCL" if mode == "torch" else "phalanx DDP"
    with lighthouse_process("--min-replicas", str(GROUPS)) as (address, _):
        port = free_port()
        procs = [
            start_worker(
                SCRIPT,
                worker=mode,
                rank=rank,
                port=port,
                lighthouse=address,
                steps=args.steps,
                warmup=args.warmup,
                width=args.width,
                out=out,
                device=args.accel,
            )
            for rank in range(GROUPS)
        ]
        try:
            got = worker_results(procs, side, timeout=min(180.0, deadline.left()))
        except subprocess.TimeoutExpired:
            raise PhaseFailed(f"{side}: its ranks did not finish in time") from None
        except (RuntimeError, ValueError, IndexError) as e:
            raise PhaseFailed(f"{side}: {e} (its traceback is above)") from None
    if len({r["fingerprint"] for r in got}) > 1:
        raise PhaseFailed(
            f"{side}: the ranks' parameters differ after {args.warmup + args.steps} steps "
            f"(fingerprints {sorted(r['fingerprint'] for r in got)}, steps committed "
            f"{[r['committed'] for r in got]}): the averaged gradients were not the same"
        )
    if min(r["committed"] for r in got) < args.steps:  # the warm-up's may fail
        raise PhaseFailed(
            f"{side}: steps committed {[r['committed'] for r in got]} of "
            f"{args.warmup + args.steps}, with no failure injected"
        )
    return max(r["median_ms"] for r in got), statistics.mean(r["cpu_ms"] for r in got)


def step_result(rounds: list[tuple], params: int, steps: int) -> Phase:
    """The step phase's rows and figures from its rounds: ((torch ms, torch CPU ms),
    (phalanx ms, phalanx CPU ms)) each."""
    torch_ms = [t[0] for t, _ in rounds]
    ours_ms = [p[0] for _, p in rounds]
    result = {
        "params": params,
        "steps": steps,
        "rounds": len(rounds),
        "torch_ddp_nccl_ms": spread(torch_ms),
        "phalanx_ms": spread(ours_ms),
        "ratio": spread([p[0] / t[0] for t, p in rounds]),
        "cpu_ratio": spread([p[1] / t[1] for t, p in rounds]),
    }
    rows = [
        ("step: model", f"MLP of {params / 1e6:.1f}M parameters, {GROUPS} ranks on one GPU"),
        ("step: torch DDP over NCCL (ms)", shown(result["torch_ddp_nccl_ms"])),
        ("step: phalanx DDP (ms)", shown(result["phalanx_ms"])),
        ("step: phalanx / torch", shown(result["ratio"])),
        ("step: CPU per step, phalanx / torch", shown(result["cpu_ratio"])),
    ]
    return Phase("step", True, 0.0, rows, result)
