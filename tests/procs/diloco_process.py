"""A replica group training `user_model.ConvNet` (several layers, 4.8 MB) with
phalanx.DiLoCo, for the fault tests, every forward under `user_model.SavedTensorGuard`.

Prints JSON lines: "joined" once the wrapper is made (the job's inner step, whether
this group healed), "sync_started" when a sync starts at this inner step, "sync" for
every sync that ended (its outcome and a hash of the global parameters and the outer
optimizer's state), "done" at the end. Data is seeded by (inner step, replica) so
that every group sees different samples.

`--fsdp` shards the model with FSDP2 over the group's own (one-rank) world first, as
torchtitan does, so that every parameter DiLoCo syncs is a DTensor.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import phalanx

from state_digest import digest, tensors_of
from user_model import ConvNet, SavedTensorGuard, batch


def global_hash(diloco: phalanx.DiLoCo) -> str:
    """Of every byte of the global parameters and the outer optimizer's tensors."""
    return digest(tensors_of(diloco.global_parameters(), diloco.outer_optimizer))


def shard(model: ConvNet) -> None:
    """FSDP2 over this process alone: each layer a unit, then the root."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400, help="inner steps")
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--overlap-steps", type=int, default=0)
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 parameters (DTensors)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # groups start apart
    model = ConvNet()
    if args.fsdp:
        shard(model)
    manager = phalanx.Manager(timeout=args.timeout)
    print(json.dumps({"event": "ready", "pid": os.getpid(), "t": time.time()}), flush=True)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = phalanx.DiLoCo(
        manager,
        model,
        inner,
        sync_every=args.sync_every,
        fragments=args.fragments,
        overlap_steps=args.overlap_steps,
        quantize=args.quantize,
    )
    print(
        json.dumps(
            {
                "event": "joined",
                **(vars(diloco.last_sync) if diloco.last_sync is not None else {}),
                "in_flight": diloco.last_sync is None,
                "hash": global_hash(diloco),
                "t": time.time(),
            }
        ),
        flush=True,
    )
    replica = zlib.crc32(manager.replica_id.encode())
    slot = args.sync_every // args.fragments
    guard = SavedTensorGuard()
    while diloco.inner_step < args.steps:
        t = diloco.inner_step
        diloco.zero_grad()
        x, y = batch(t, salt=replica % 997)
        with guard:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        outcome = diloco.step()
        if diloco.inner_step % slot == 0 and (outcome is None or outcome.inner_step != t + 1):
            # A sync started here and runs during the next overlap steps.
            event = {"event": "sync_started", "inner_step": diloco.inner_step}
            print(json.dumps({**event, "t": time.time()}), flush=True)
        if outcome is not None:
            line = {"event": "sync", **vars(outcome), "hash": global_hash(diloco)}
            print(json.dumps({**line, "loss": loss.item(), "t": time.time()}), flush=True)
        time.sleep(args.step_sleep)
    diloco.finish()
    manager.shutdown()
    if args.fsdp:
        dist.destroy_process_group()
    print(json.dumps({"event": "done", "inner_step": diloco.inner_step}), flush=True)


if __name__ == "__main__":
    main()
