"""A torchft HSDP training script: FSDP2 shards the model over the ranks of each
replica group, and FSDP2's all-reduce hook averages every reduce-scattered gradient
shard across the replica groups over `ManagedProcessGroup(manager)`, the way
torchtitan hosts fault tolerance. Written against torchft's public API; `phalanx run
--as-torchft` runs it on phalanx.torchft unchanged.

    phalanx run --as-torchft --replicas 2 --nproc-per-replica 2 -- \
        tests/procs/torchft_fsdp.py --steps 100

torchft builds the group's own mesh with `torchft.device_mesh`, which phalanx does
not have (it names this pattern instead): the mesh of the group's ranks is
`phalanx.hsdp.shard_mesh`, over the group's own store. With `--torchtitan` it starts
as torchtitan's trainer does instead: `init_process_group()` first (torch's own store
on MASTER_PORT, as under torchrun), the mesh from `init_device_mesh`, the managed
group `register`ed as "dp_replicate", the loss summed across the groups by a
functional all-reduce on that name. One JSON line per step and
rank (tests/procs/torchft_steplog.py); the fingerprint is of this rank's shards of
the model and the optimizer state, the same on rank r of every group.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torchft
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchft.process_group import ManagedProcessGroup
from torchft_steplog import Environment, StepLog

from phalanx.hsdp import shard_mesh

from state_digest import tensors_of

FEATURES, HIDDEN, OUT, BATCH = 8, 16, 3, 8  # OUT=3 over 2 ranks: uneven shards


def batch(group: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank of each group its own data, drawn from (group, rank, step)."""
    g = torch.Generator().manual_seed(10_000 * group + 100 * rank + step % 50)
    x = torch.randn(BATCH, FEATURES, generator=g)
    y = torch.stack([x[:, :4].sum(1), x[:, 4:].mean(1), torch.sin(x).mean(1)], dim=1)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True, help="stop at this many steps")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--torchtitan", action="store_true", help="torchtitan's start-up")
    args = parser.parse_args()
    env = Environment.read()
    torch.set_num_threads(1)
    if args.torchtitan:
        dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR/PORT

    timeout = timedelta(seconds=args.timeout)

    # The model and its optimizer are made below, once the group's mesh exists; a heal
    # comes only at the first quorum, after both.
    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"train_fsdp_{env.replica_group}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    # Every rank of every group builds the same weights: FSDP2 keeps each rank's slice.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
    if args.torchtitan:
        mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("dp_shard",))
    else:
        mesh = shard_mesh(manager.phalanx)
    for unit in (model[0], model[2]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)

    pg = ManagedProcessGroup(manager)
    if args.torchtitan:
        pg.register("dp_replicate")

    def average_across_groups(shard: torch.Tensor) -> None:
        dist.all_reduce(shard, op=dist.ReduceOp.AVG, group=pg)

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(average_across_groups)
    optimizer = torchft.Optimizer(manager, inner)
    log = StepLog(manager, env)

    while manager.current_step() < args.steps:
        started, before = time.time(), manager.current_step()
        optimizer.zero_grad()  # starts the quorum
        manager.wait_quorum()  # a heal writes the shards before FSDP2 reads them
        x, y = batch(env.replica_group, env.rank, manager.current_step())
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # the hook averages each gradient shard across the groups
        extra = {}
        if args.torchtitan:  # its loss sync across the groups, by the group's name
            summed = funcol.all_reduce(loss.detach(), "sum", group="dp_replicate")
            extra["loss_sum"] = funcol.wait_tensor(summed).item()
        optimizer.step()
        state = lambda: tensors_of(model.state_dict(), inner)  # noqa: E731
        log.write(started, loss.item(), log.committed(before), state, **extra)
    pg.unregister()
    manager.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
