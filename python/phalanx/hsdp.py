"""`phalanx.fully_shard_hsdp`: hybrid sharded data parallelism. FSDP2 shards the model
over the ranks of each replica group; the gradient shards are averaged across the
replica groups of the current quorum through the fault-tolerant process group, shard
i of every group together (rank i of every group holds the same slice of the model).

    model = phalanx.fully_shard_hsdp(model, manager, units=model.layers)
    optimizer = phalanx.Optimizer(manager, torch.optim.AdamW(model.parameters()))
    for x, y in batches:
        optimizer.zero_grad()            # starts the quorum
        loss_fn(model(x), y).backward()  # FSDP2 reduce-scatters inside the group
        optimizer.step()                 # averages the shards across groups, votes, steps

Inside a group FSDP2 runs as it always does, on torch.distributed's default process
group made of the group's W ranks (a plain group: a rank's death ends its replica
group, and the launcher restarts it whole). Across groups nothing is plain: a failed
or aborted all-reduce only makes the step's vote "no".

Why the cross-group all-reduce waits for `optimizer.step()`: the step's quorum is taken
at the first cross-group all-reduce, and with it a healing rank writes its shards in
place and an up-to-date rank lends its shards, without a copy, to healers. Both are
safe only while nothing else reads or writes the shards: after `backward()` returns
(FSDP2's post-backward callback has resharded every parameter and waited for its
reduce-scatters; no all-gather is in flight, none starts before the next forward) and
before the optimizer writes them (`optimizer.step()` runs after `should_commit()` has
withdrawn the lent state). Taking FSDP2's state dict any earlier would be wrong
anyway: it reshards the module as a side effect, under the running backward.

A healing rank i fetches only its own shards, from rank i of every up-to-date group,
striped across them, straight into its DTensors' local tensors; the optimizer state of
an optimizer over FSDP2's parameters is sharded the same way and heals the same way.

>>> import torch, phalanx
>>> with phalanx.LighthouseServer(bind="127.0.0.1:0", join_timeout=0.05) as lighthouse:
...     manager = phalanx.Manager(replica_id="solo", lighthouse=lighthouse.address)
...     model = phalanx.fully_shard_hsdp(torch.nn.Linear(4, 2), manager)
...     optimizer = phalanx.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1))
...     optimizer.zero_grad()
...     model(torch.ones(3, 4)).sum().backward()
...     optimizer.step(), manager.current_step(), type(model.weight).__name__
...     manager.shutdown()
(True, 1, 'DTensor')
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from phalanx.buckets import BUCKET_BYTES, cut
from phalanx.manager import Manager

__all__ = ["fully_shard_hsdp", "shard_mesh"]

#: Where the group's ranks meet to form torch.distributed's default process group.
STORE_PREFIX = "phalanx/hsdp"
MESH_DIM = "shard"


def shard_mesh(manager: Manager, device_type: str = "cpu") -> DeviceMesh:
    """The 1-D device mesh of this replica group's W ranks, over which FSDP2 shards.

    Its process group is torch.distributed's default one: built here over the group's
    own store unless the caller has built it already, with this group's ranks (and
    only them). Use it to apply `fully_shard` yourself before `fully_shard_hsdp`."""
    rank, world_size = manager.group_rank, manager.group_world_size
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"torch.distributed's default group is rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but this is rank {rank} of a replica group of "
                f"{world_size}; HSDP shards over the replica group only: leave the default "
                "group to phalanx, or build it over the group's ranks alone"
            )
    else:
        backend = "gloo" if device_type == "cpu" else f"cpu:gloo,{device_type}:nccl"
        # The quorum's deadline: the group's ranks may start seconds apart, and a hung
        # rank ends only its own group (the other groups go on without it at once).
        dist.init_process_group(
            backend,
            store=manager.group_store(STORE_PREFIX),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=manager.timeouts.quorum),
        )
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=(MESH_DIM,))


def fully_shard_hsdp(
    model: nn.Module,
    manager: Manager,
    *,
    units: Iterable[nn.Module] = (),
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    name: str = "model",
) -> nn.Module:
    """Shards `model` with FSDP2 over this replica group's ranks and averages its
    gradient shards across the replica groups of each step's quorum. Returns the
    model (now an `FSDPModule` whose parameters are DTensors), ready for a
    `phalanx.Optimizer`.

    `units`: submodules that FSDP2 all-gathers one at a time (e.g. the transformer
    blocks), each sharded before the root, as in torchtitan. `reshard_after_forward`
    and `mp_policy` go to `fully_shard`. A model already sharded with `fully_shard`
    over `shard_mesh(manager, ...)` is taken as it is (then `units`, and the other
    two, must be left out).

    Every rank of the group starts from group rank 0's weights (broadcast before
    sharding), and every group from the first group's (the manager's init sync). The
    model's state is registered with the manager as `name`.
    """
    units = list(units)
    if isinstance(model, FSDPModule):
        if units or reshard_after_forward is not None or mp_policy is not None:
            raise ValueError(
                "the model is sharded already; pass units, reshard_after_forward and "
                "mp_policy to your own fully_shard calls, or give fully_shard_hsdp the "
                "unsharded model"
            )
    else:
        _shard(model, manager, units, reshard_after_forward, mp_policy)
    params = _sharded_parameters(model, manager)
    manager.register_state(name, model.state_dict, model.load_state_dict)
    averager = _CrossGroupAverage(params, manager, bucket_bytes)
    manager.register_pre_commit(averager.launch)
    return model


def _shard(
    model: nn.Module,
    manager: Manager,
    units: list[nn.Module],
    reshard_after_forward: bool | None,
    mp_policy: MixedPrecisionPolicy | None,
) -> None:
    inside = {id(m) for m in model.modules()}
    for unit in units:
        if id(unit) not in inside or unit is model:
            raise ValueError(
                f"unit {type(unit).__name__} is not a submodule of the model; pass the "
                "blocks FSDP2 should all-gather one at a time, e.g. units=model.layers"
            )
    tensors = [*model.parameters(), *model.buffers()]
    devices = {t.device.type for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"the model lies on several devices ({sorted(devices)}); move it to one first"
        )
    device_type = devices.pop() if devices else "cpu"
    if device_type == "meta":
        raise ValueError(
            "the model is on the meta device; materialize it (every rank of a group the "
            "same) before fully_shard_hsdp, which broadcasts group rank 0's weights"
        )
    mesh = shard_mesh(manager, device_type)
    if manager.group_world_size > 1:
        # FSDP2 keeps each rank's slice of its own copy: the copies must agree.
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, src=0)
    options: dict = {"mesh": mesh}
    if reshard_after_forward is not None:
        options["reshard_after_forward"] = reshard_after_forward
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)


def _sharded_parameters(model: nn.Module, manager: Manager) -> list[nn.Parameter]:
    """The trainable parameters, each a DTensor sharded over this group's ranks only."""
    params = []
    for path, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not isinstance(p, DTensor):
            raise ValueError(
                f"parameter {path!r} is not sharded by FSDP2 (a plain tensor); phalanx HSDP "
                "averages FSDP2's gradient shards only: shard the whole model"
            )
        if p.device_mesh.ndim != 1 or p.device_mesh.size() != manager.group_world_size:
            raise ValueError(
                f"parameter {path!r} is sharded over a mesh of shape "
                f"{tuple(p.device_mesh.shape)}; HSDP shards over the replica group's "
                f"{manager.group_world_size} rank(s) only: use shard_mesh(manager)"
            )
        params.append(p)
    return params


class _Bucket:
    """Gradient shards averaged as one flat tensor: the shard of each parameter, in
    order, so that rank i of every group sends the same layout."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params

    def launch(self, manager: Manager) -> None:
        shards = [
            p.grad.to_local().reshape(-1)
            if p.grad is not None
            else torch.zeros(p.to_local().numel(), dtype=p.dtype, device=p.to_local().device)
            for p in self.params
        ]
        flat = torch.cat(shards)
        manager.allreduce(flat, then=self._scatter)

    def _scatter(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            if p.grad is None:
                # Some group used it this step: every group applies the same gradient.
                p.grad = torch.zeros_like(p)
            local = p.grad.to_local()
            n = local.numel()
            local.copy_(flat[offset : offset + n].view_as(local))
            offset += n


def _buckets(params: list[nn.Parameter], limit: int) -> Iterator[list[nn.Parameter]]:
    """Parameters of one dtype and device per bucket, cut at about `limit` bytes."""
    kinds: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault((p.dtype, p.to_local().device), []).append(p)
    for same in kinds.values():
        yield from cut(same, lambda p: p.to_local().numel() * p.element_size(), limit)


class _CrossGroupAverage:
    """Averages the gradient shards across the quorum when the step commits.

    FSDP2 has averaged the gradients over the group's ranks (its reduce-scatter);
    this averages each rank's shard with the same-numbered ranks of the other groups,
    so the result is the mean over every rank of every participating group."""

    def __init__(self, params: list[nn.Parameter], manager: Manager, bucket_bytes: int):
        self._manager = manager
        self._buckets = [_Bucket(b) for b in _buckets(params, bucket_bytes)]

    def launch(self) -> None:
        """Runs at the start of `should_commit()`, after backward: the safe point (see
        the module's docstring). The manager waits for these all-reduces before it
        votes."""
        with torch.no_grad():
            for bucket in self._buckets:
                bucket.launch(self._manager)
