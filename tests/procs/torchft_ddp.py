"""A torchft DDP training script: Manager with state callbacks (model + optimizer),
DistributedSampler over a small synthetic image dataset, torchft's Optimizer wrapper
and DistributedDataParallel around a CNN of several gradient buckets
(`user_model.ConvNet`), its loop asking the manager nothing before the forward.
Written against torchft's public API; `phalanx run --as-torchft` runs it on
phalanx.torchft unchanged.

    phalanx run --as-torchft --replicas 3 -- tests/procs/torchft_ddp.py --steps 200

Prints one JSON line per step (tests/procs/torchft_steplog.py).
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torchft
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer
from torchft_steplog import Environment, StepLog

from state_digest import tensors_of
from user_model import CHANNELS, SIDE, ConvNet, SavedTensorGuard


def synthetic_dataset(samples: int = 512) -> TensorDataset:
    """The same dataset in every group: images labelled by their brightest channel."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, CHANNELS, SIDE, SIDE, generator=g)
    return TensorDataset(x, x.mean(dim=(2, 3)).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True, help="stop at this many steps")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    env = Environment.read()
    torch.set_num_threads(1)

    dataset = synthetic_dataset()
    sampler = DistributedSampler(
        dataset,
        replica_rank=env.replica_group,
        num_replica_groups=env.replica_groups,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
    )
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    module = ConvNet()
    inner = torch.optim.AdamW(module.parameters(), lr=args.lr)

    def state_dict() -> dict:
        return {"model": module.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state: dict) -> None:
        module.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"train_ddp_{env.replica_group}",
        timeout=timeout,
    )
    model = DistributedDataParallel(manager, module)
    optimizer = Optimizer(manager, inner)
    log = StepLog(manager, env)
    guard = SavedTensorGuard()

    epoch = 0
    while manager.current_step() < args.steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            started = time.time()
            before = manager.current_step()
            optimizer.zero_grad()
            with guard:
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            state = lambda: tensors_of(module.state_dict(), inner)  # noqa: E731
            log.write(started, loss.item(), log.committed(before), state)
            if manager.current_step() >= args.steps:
                break
    manager.shutdown()


if __name__ == "__main__":
    main()
