"""One rank of a replica group training a small model with phalanx HSDP, for the tests.

Prints one JSON line per step: the step it ran, whether it committed, how many groups
contributed, and a hash of this rank's shards (model and optimizer) after the step.
Every rank may start from other weights (--seed): phalanx makes the group start from
its rank 0's and every group from the first group's. Batches are seeded by (step,
data index, group rank), so that a test can rebuild the combined batch of every step.

`--model convnet` trains `user_model.ConvNet` instead (a user's model of several
layers, each an FSDP2 unit), every forward under `user_model.SavedTensorGuard`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import phalanx

from state_digest import state_hash
from user_model import ConvNet, SavedTensorGuard
from user_model import batch as image_batch

IN, HIDDEN, OUT = 8, 16, 3  # OUT=3 over 2 ranks: uneven shards
BATCH = 4


def build_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def build_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batch(step: int, data_index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + data_index * 10 + rank)
    x = torch.randn(BATCH, IN, generator=g)
    y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1), x.abs().mean(1)], dim=1)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=-1, help="model init; -1: random")
    parser.add_argument("--data-index", type=int, default=0)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    parser.add_argument("--save", default="", help="group rank 0 saves the full model here")
    parser.add_argument("--model", choices=["mlp", "convnet"], default="mlp")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    seed = args.seed if args.seed >= 0 else int.from_bytes(os.urandom(4), "little")
    manager = phalanx.Manager(timeout=args.timeout)
    if args.model == "convnet":
        torch.manual_seed(seed)
        model = ConvNet()
        units = [model.conv1, model.conv2, model.fc1, model.fc2, model.fc3]
    else:
        model = build_model(seed)
        units = [model[0], model[2]]
    model = phalanx.fully_shard_hsdp(model, manager, units=units)
    guard = SavedTensorGuard()
    optimizer = phalanx.Optimizer(manager, build_optimizer(args.optimizer, model.parameters()))
    rank = manager.group_rank
    ready = {"event": "ready", "pid": os.getpid(), "rank": rank, "t": time.time()}
    print(json.dumps(ready), flush=True)

    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()
        if args.model == "convnet":
            x, y = image_batch(step, salt=args.data_index * 10 + rank)
            with guard:
                loss = nn.functional.cross_entropy(model(x), y)
        else:
            x, y = batch(step, args.data_index, rank)
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        committed = optimizer.step()
        print(
            json.dumps(
                {
                    "event": "step",
                    "step": step,
                    "committed": committed,
                    "after": manager.current_step(),
                    "rank": rank,
                    "quorum_id": manager.quorum_id,
                    "participants": manager.num_participants(),
                    "hash": state_hash(model, optimizer.optimizer),
                    "t": time.time(),
                }
            ),
            flush=True,
        )
        time.sleep(args.step_sleep)
    if args.save:
        # full_tensor() all-gathers inside the group: every rank takes part.
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, args.save)
    manager.shutdown()
    dist.destroy_process_group()
    print(json.dumps({"event": "done", "step": manager.current_step()}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
