"""`phalanx.Optimizer`: wraps a torch optimizer so that a training loop needs no
other change: `zero_grad()` starts the step's quorum, `step()` commits or discards.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.manager import Manager


class Optimizer:
    """A torch optimizer whose steps are transactions of `manager`.

    Its state is registered with the manager as "optimizer", so a healing group
    receives it from its peers.
    """

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer, name: str = "optimizer"):
        self.manager = manager
        self.optimizer = optimizer
        manager.register_state(name, optimizer.state_dict, optimizer.load_state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> bool:
        """Applies the step if the group commits it; returns whether it did."""
        if self.manager.should_commit():
            self.optimizer.step(closure)
            return True
        return False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
