"""torchft.checkpointing.pg_transport: its process-group transport, unused on phalanx."""

from __future__ import annotations

from phalanx.torchft.checkpointing.transport import CheckpointTransport

__all__ = ["PGTransport"]


class PGTransport(CheckpointTransport):
    """torchft's process-group transport: unused on phalanx."""
