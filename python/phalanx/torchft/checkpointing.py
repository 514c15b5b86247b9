"""torchft's checkpoint transports, which phalanx does not need: a healing group
streams the state from every up-to-date peer's state server, striped over them and
checksummed end to end, straight into its own tensors. A transport made here may
be passed to `Manager(checkpoint_transport=…)`, which logs once that it is unused.

>>> from datetime import timedelta
>>> transport = PGTransport(None, timeout=timedelta(seconds=10), device="cpu")
>>> transport.metadata()
Traceback (most recent call last):
...
RuntimeError: phalanx heals through its own state servers; PGTransport is not used ...
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport"]


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


class HTTPTransport(CheckpointTransport):
    """torchft's HTTP transport: unused on phalanx."""


class PGTransport(CheckpointTransport):
    """torchft's process-group transport: unused on phalanx."""
