"""A torchft DiLoCo training script: a model of two submodules, each a fragment that
syncs in turn (streaming DiLoCo), AdamW inner steps and an SGD-Nesterov outer
optimizer, inside `with DiLoCo(...)` around a plain torch training loop. Written
against torchft's public API; `phalanx run --as-torchft` runs it on phalanx.torchft
unchanged.

    phalanx run --as-torchft --replicas 3 -- tests/procs/torchft_diloco.py --steps 40

Its flags and each group's data are those of tests/procs/torchft_local_sgd.py:
`--steps` counts the Manager's steps (syncs committed). One JSON line per inner step
(tests/procs/torchft_steplog.py); `committed` is true on the inner step whose sync
committed, and its fingerprint is of the global parameters and the outer
optimizer's state, which every group holds the same after a committed sync.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torchft
from torch import nn
from torchft.local_sgd import DiLoCo
from torchft_local_sgd import FEATURES, HIDDEN, batch, sync_arguments
from torchft_steplog import Environment, StepLog

from state_digest import tensors_of


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.front = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.back = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back(self.front(x))


def global_state(diloco: DiLoCo) -> list[torch.Tensor] | None:
    """The global parameters and the outer optimizer's state: what a committed sync
    leaves the same on every group. torchft has no public name for them; on
    phalanx.torchft they are those of the phalanx DiLoCo underneath (None elsewhere)."""
    inner = getattr(diloco, "_inner", None)
    if inner is None:
        return None
    return tensors_of(inner.global_parameters(), inner.outer_optimizer)


#: An outer learning rate of 0.7 (the DiLoCo paper's, for hundreds of inner steps a
#: round) makes the loss of rounds this short climb: the momentum multiplies each
#: pseudo-gradient about tenfold.
OUTER_LR = 0.3


def main() -> None:
    args = sync_arguments()
    env = Environment.read()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model = Net()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=0.9, nesterov=True)

    def state_dict() -> dict:
        return {
            "model": model.state_dict(),
            "inner_optim": inner.state_dict(),
            "outer_optim": outer.state_dict(),
        }

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner_optim"])
        outer.load_state_dict(state["outer_optim"])

    timeout = timedelta(seconds=args.timeout)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        # torchft's DiLoCo takes its quorum at the sync itself, and requires this.
        use_async_quorum=False,
        replica_id=f"train_diloco_{env.replica_group}",
        timeout=timeout,
    )
    log = StepLog(manager, env)
    joining = time.time()
    with DiLoCo(
        manager, [model.front, model.back], inner, outer, sync_every=args.sync_every
    ) as diloco:
        # The first sync ran in DiLoCo's constructor; a restarted group heals in it.
        log.transaction_ended()
        state = lambda: global_state(diloco)  # noqa: E731
        log.write(joining, None, log.committed(0), state, synced=True, local_step=0)
        local_step = 0
        while manager.current_step() < args.steps:
            started, before = time.time(), manager.current_step()
            local_step += 1
            x, y = batch(env.replica_group, local_step)
            inner.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            inner.step()  # counted by DiLoCo; every sync_every / 2 steps a fragment syncs
            synced = log.transaction_ended()
            committed = synced and log.committed(before)
            log.write(started, loss.item(), committed, state, synced=synced, local_step=local_step)
    manager.shutdown()


if __name__ == "__main__":
    main()
