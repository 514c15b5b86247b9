"""torchft's optimizer wrapper: `zero_grad()` starts the step's quorum, `step()`
steps the optimizer only if the step commits.

Unlike `phalanx.Optimizer`, it registers no state: as in torchft, the state a
healing group receives is what the Manager's `state_dict` callbacks return.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OptimizerWrapper"]


class OptimizerWrapper(torch.optim.Optimizer):
    """`optim`, with every step a transaction of `manager` (a phalanx.torchft Manager)."""

    def __init__(self, manager: Any, optim: torch.optim.Optimizer) -> None:
        # The wrapped optimizer keeps the state; torch's base class is not initialised.
        self.optim = optim
        self.manager = manager

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError(
                "a closure re-runs the forward pass outside the step's transaction; step "
                "without one"
            )
        if self.manager.should_commit():
            self.optim.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state
