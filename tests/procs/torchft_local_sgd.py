"""A torchft LocalSGD training script: each group trains with a plain torch SGD on
its own data inside `with LocalSGD(...)`, and every `sync_every` steps the live
groups' parameters are averaged. Written against torchft's public API; `phalanx run
--as-torchft` runs it on phalanx.torchft unchanged.

    phalanx run --as-torchft --replicas 3 -- tests/procs/torchft_local_sgd.py --steps 40

`--steps` counts the Manager's steps (syncs committed). One JSON line per inner step
(tests/procs/torchft_steplog.py); `committed` is true on the inner step whose sync
committed, and its fingerprint is of the model's parameters, which a committed sync
leaves the same on every group.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta

import torch
import torchft
from torch import nn
from torchft.local_sgd import LocalSGD
from torchft_steplog import Environment, StepLog

FEATURES, HIDDEN, BATCH = 8, 16, 16


def batch(group: int, local_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's own data: drawn from (group, this life's step count)."""
    g = torch.Generator().manual_seed(100_000 * group + local_step)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.5 * x[:, 4:].mean(1, keepdim=True)


def sync_arguments() -> argparse.Namespace:
    """`--steps` (syncs committed), `--sync-every` and `--timeout`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True, help="stop at this many syncs")
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=10.0)
    return parser.parse_args()


def main() -> None:
    args = sync_arguments()
    env = Environment.read()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    timeout = timedelta(seconds=args.timeout)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"train_local_sgd_{env.replica_group}",
        timeout=timeout,
    )
    log = StepLog(manager, env)
    joining = time.time()
    with LocalSGD(manager, model, optimizer, sync_every=args.sync_every):
        # The first sync ran in LocalSGD's constructor; a restarted group heals in it.
        log.transaction_ended()
        state = lambda: list(model.state_dict().values())  # noqa: E731
        joined = log.committed(0)
        log.write(joining, None, joined, state, synced=True, local_step=0)
        local_step = 0
        while manager.current_step() < args.steps:
            started, before = time.time(), manager.current_step()
            local_step += 1
            x, y = batch(env.replica_group, local_step)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()  # counted by LocalSGD; every sync_every steps it syncs
            synced = log.transaction_ended()
            committed = synced and log.committed(before)
            log.write(
                started,
                loss.item(),
                committed,
                state,
                synced=synced,
                local_step=local_step,
            )
    manager.shutdown()


if __name__ == "__main__":
    main()
