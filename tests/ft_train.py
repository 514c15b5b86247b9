"""A replica group's rank training a small model with phalanx DDP, for the tests.

Prints one JSON line per step: the step it ran, whether it committed, the quorum, and
a hash of its model and optimizer state after the step. Data is seeded by (step,
replica) so that every group sees different samples, as in a real job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

import phalanx

from state_digest import state_hash


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()

    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # groups start apart
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    manager = phalanx.Manager(timeout=args.timeout)
    ddp = phalanx.DistributedDataParallel(model, manager)
    optimizer = phalanx.Optimizer(manager, torch.optim.Adam(model.parameters(), lr=0.01))
    rank = manager.group_rank
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)

    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(step * 1000 + hash(manager.replica_id) % 997 + rank)
        x = torch.randn(32, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        committed = optimizer.step()
        print(
            json.dumps(
                {
                    "event": "step",
                    "step": step,
                    "committed": committed,
                    "after": manager.current_step(),
                    "quorum_id": manager.quorum_id,
                    "participants": manager.num_participants(),
                    "loss": loss.item(),
                    "hash": state_hash(model, optimizer.optimizer),
                    "t": time.time(),
                }
            ),
            flush=True,
        )
        time.sleep(args.step_sleep)
    manager.shutdown()
    print(json.dumps({"event": "done", "step": manager.current_step()}), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
