"""One rank of a replica group running collectives on
`phalanx.torchft.process_group.ManagedProcessGroup`, for tests/test_torchft_process_group.py.

Modes (one JSON line per event on stdout):

- `reduce`: a single-rank group; each step all-reduces `--value` with
  `dist.all_reduce` (SUM, and AVG through an async work's future) and the functional
  collectives (AVG by the group, SUM by its registered name, both waited with
  `wait_tensor`), then votes.
- `kill`: a single-rank group stepping with an AVG all-reduce each step. With
  `--stall-after N` it stops before its all-reduce once it has committed N steps
  with a peer (the test kills it there); with `--exit-after-failure N` it exits 0
  once it has committed N steps after its first failed one.
- `fsdp`: a rank of a replica group of W ranks (RANK, WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT, PHALANX_REPLICA_ID, PHALANX_LIGHTHOUSE in the environment): FSDP2's
  `fully_shard` over the group's ranks, and an all-reduce hook that averages every
  reduce-scattered gradient shard across the groups over ManagedProcessGroup, the way
  torchtitan hosts fault tolerance: the group `register`ed as "dp_replicate", the
  loss summed across the groups by a functional all-reduce. It saves its full
  parameters at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

import phalanx
from phalanx.torchft.process_group import ManagedProcessGroup

IN, HIDDEN, OUT = 6, 8, 3  # OUT=3 over 2 ranks: uneven shards
BATCH = 4
LR = 0.05


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(data_index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch every step, so the loss falls step after step."""
    g = torch.Generator().manual_seed(data_index * 10 + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.stack([x[:, :3].sum(1), x[:, 3:].mean(1), x.abs().mean(1)], dim=1)


def reduce(args: argparse.Namespace) -> None:
    manager = phalanx.Manager(
        replica_id=args.replica_id,
        lighthouse=args.lighthouse,
        timeout=args.timeout,
        init_sync=False,
    )
    pg = ManagedProcessGroup(manager)
    for step in range(args.steps):
        manager.start_quorum()
        summed = torch.full((3,), args.value)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=pg)
        averaged = torch.full((3,), args.value)
        work = dist.all_reduce(averaged, op=dist.ReduceOp.AVG, group=pg, async_op=True)
        (from_future,) = work.get_future().value()
        by_group = funcol.wait_tensor(funcol.all_reduce(torch.full((2,), args.value), "avg", pg))
        by_name = funcol.wait_tensor(
            funcol.all_reduce(torch.full((2,), args.value), "sum", pg.group_name)
        )
        size, rank = pg.size(), pg.rank()
        emit(
            event="step",
            step=step,
            sum=summed.tolist(),
            avg=averaged.tolist(),
            future_is_tensor=from_future is averaged,
            functional_avg=by_group.tolist(),
            functional_sum=by_name.tolist(),
            size=size,
            rank=rank,
            world_size=dist.get_world_size(pg),
            committed=manager.should_commit(),
        )
    pg.unregister()
    manager.shutdown()


def kill(args: argparse.Namespace) -> None:
    manager = phalanx.Manager(
        replica_id=args.replica_id, lighthouse=args.lighthouse, timeout=args.timeout
    )
    pg = ManagedProcessGroup(manager)
    together = after_failure = 0
    failed = False
    while True:
        manager.start_quorum()
        manager.wait_quorum()
        participants = manager.num_participants()
        if args.stall_after is not None and together >= args.stall_after:
            emit(event="stalled", step=manager.current_step(), participants=participants)
            time.sleep(600)
        t = torch.full((4,), args.value)
        work = dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg, async_op=True)
        reduced = work.wait()
        step = manager.current_step()
        committed = manager.should_commit()
        emit(
            event="step",
            step=step,
            committed=committed,
            reduced=reduced,
            failure=manager.failure,
            participants=participants,
            value=t.tolist(),
        )
        together += committed and participants == 2
        if failed and committed:
            after_failure += 1
        failed = failed or not committed
        if args.exit_after_failure is not None and after_failure >= args.exit_after_failure:
            break
        time.sleep(args.step_sleep)
    pg.unregister()
    manager.shutdown()
    emit(event="done")


def fsdp(args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from phalanx.hsdp import shard_mesh

    # Every rank of every group starts from the same weights: no group heals.
    manager = phalanx.Manager(timeout=args.timeout, init_sync=False)
    rank = manager.group_rank
    model = build_model()
    mesh = shard_mesh(manager)  # torch.distributed's default group: this group's ranks
    for unit in (model[0], model[2]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    manager.register_state("model", model.state_dict, model.load_state_dict)
    manager.register_state("optim", optimizer.state_dict, optimizer.load_state_dict)

    # As torchtitan's TorchFTManager does: one of torch's named groups.
    pg = ManagedProcessGroup(manager)
    pg.register("dp_replicate")

    def average_across_groups(shard: torch.Tensor) -> None:
        dist.all_reduce(shard, op=dist.ReduceOp.AVG, group=pg)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(average_across_groups)

    x, y = batch(args.data_index, rank)
    for step in range(args.steps):
        manager.start_quorum()
        manager.wait_quorum()  # a heal, if any, before FSDP2 reads the parameters
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        # torchtitan's loss sync across the groups: functional, by the group.
        summed = funcol.wait_tensor(funcol.all_reduce(loss.detach(), "sum", group=pg))
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        optimizer.zero_grad()
        emit(
            event="step",
            step=step,
            rank=rank,
            loss=loss.item(),
            loss_sum=summed.item(),
            committed=committed,
            participants=manager.num_participants(),
            world=[dist.get_rank(pg), dist.get_world_size(pg), str(dist.get_backend(pg))],
        )
    # full_tensor() all-gathers inside the group: every rank takes part.
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    torch.save(full, args.save)
    pg.unregister()
    manager.shutdown()
    dist.destroy_process_group()
    emit(event="done", rank=rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["reduce", "kill", "fsdp"])
    parser.add_argument("--replica-id", default=None)
    parser.add_argument("--lighthouse", default=None)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--value", type=float, default=1.0)
    parser.add_argument("--stall-after", type=int, default=None)
    parser.add_argument("--exit-after-failure", type=int, default=None)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--data-index", type=int, default=0)
    parser.add_argument("--save", default="")
    args = parser.parse_args()
    {"reduce": reduce, "kill": kill, "fsdp": fsdp}[args.mode](args)
    sys.exit(0)


if __name__ == "__main__":
    main()
