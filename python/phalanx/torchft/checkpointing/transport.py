"""torchft.checkpointing.transport: the base of its checkpoint transports, which
phalanx accepts and does not use (see `phalanx.torchft.checkpointing`)."""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointTransport"]


class CheckpointTransport:
    """A way to move a state to a healing group; on phalanx only a placeholder that
    the Manager accepts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unused(*_: Any, **__: Any) -> Any:
            raise RuntimeError(
                f"phalanx heals through its own state servers; {type(self).__name__} is "
                f"not used (its {name}() does nothing on phalanx). Register the state "
                "with Manager(load_state_dict=…, state_dict=…) instead"
            )

        return unused
