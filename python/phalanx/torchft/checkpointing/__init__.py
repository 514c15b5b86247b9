"""torchft's checkpoint transports, which phalanx does not need: a healing group
streams the state from every up-to-date peer's state server, striped over them and
checksummed end to end, straight into its own tensors. A transport made here may
be passed to `Manager(checkpoint_transport=…)`, which logs once that it is unused.
Its modules are torchft's: `transport` (`CheckpointTransport`), `http_transport`
(`HTTPTransport`) and `pg_transport` (`PGTransport`), so that
`from torchft.checkpointing.pg_transport import PGTransport` imports as written.

>>> from datetime import timedelta
>>> transport = PGTransport(None, timeout=timedelta(seconds=10), device="cpu")
>>> transport.metadata()
Traceback (most recent call last):
...
RuntimeError: phalanx heals through its own state servers; PGTransport is not used ...
"""

from __future__ import annotations

from phalanx.torchft.checkpointing.http_transport import HTTPTransport
from phalanx.torchft.checkpointing.pg_transport import PGTransport
from phalanx.torchft.checkpointing.transport import CheckpointTransport

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport"]
