"""torchft.checkpointing.http_transport: its HTTP transport, unused on phalanx."""

from __future__ import annotations

from phalanx.torchft.checkpointing.transport import CheckpointTransport

__all__ = ["HTTPTransport"]


class HTTPTransport(CheckpointTransport):
    """torchft's HTTP transport: unused on phalanx."""
